"""launch: executors that start one hpcrl MPI world (local mpiexec, Slurm hetjob), signals, requeue."""
