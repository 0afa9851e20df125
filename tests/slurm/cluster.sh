#!/usr/bin/env bash
# A real single-host Slurm cluster for hpcrl's tests (and for trying hpcrl without a cluster).
#
#   tests/slurm/cluster.sh start   install slurm-wlm + munge if missing, write the configs, start munged,
#                                  slurmctld and one slurmd per virtual node, wait until every node is idle
#   tests/slurm/cluster.sh stop    cancel jobs, stop every daemon this script started, kill orphaned
#                                  slurmstepd and job processes; `stop --wipe` also deletes the state dir
#   tests/slurm/cluster.sh status  print daemons, nodes and queue; exit 0 only when the cluster is healthy
#   tests/slurm/cluster.sh restart stop + start
#
# Needs root and Debian/Ubuntu (apt). No systemd is used: the daemons are started directly.
# Why virtual nodes: a heterogeneous job needs one node per component (the backfill scheduler never puts
# two components on one node), and Debian's Slurm is built with multiple-slurmd support, so several
# slurmd daemons on 127.0.0.1 (one port each) give a multi-node cluster on one machine.
#
# Knobs (environment; a change is detected from the rendered slurm.conf and triggers a restart):
#   HPCRL_SLURM_NODES (4)        virtual nodes n1..nN, >= 1 (>= 2 for hetjobs)
#   HPCRL_SLURM_CPUS (4)         CPUs per node (may exceed the real cores: config_overrides)
#   HPCRL_SLURM_MEM_MB (4000)    RealMemory per node (not enforced: CR_CPU)
#   HPCRL_SLURM_GPUS (2)         fake GPUs per node (gres files are symlinks to /dev/null)
#   HPCRL_SLURM_GRACE_S (10)     GraceTime of the preemptable `debug` partition
#   HPCRL_SLURM_STATE (/var/lib/hpcrl-slurm)  state, logs, pid files
#   HPCRL_SLURM_CTLD_PORT (6817), HPCRL_SLURM_SLURMD_PORT0 (17001; node i uses PORT0+i-1)
#   HPCRL_SLURM_TIMEOUT_S (60)   deadline for the nodes to become idle
#   HPCRL_SLURM_KICKER (1)       run the loop that wakes the backfill scheduler for pending hetjobs
#   HPCRL_SLURM_ACCOUNTING (1)   job accounting (sacct): slurmdbd on a private MariaDB in the state dir;
#                                0 runs without it (sacct then fails, as on clusters without accounting)
#   HPCRL_SLURM_DB_PORT (3307), HPCRL_SLURM_DBD_PORT (6819)   MariaDB's and slurmdbd's ports (127.0.0.1)
set -euo pipefail

NODES="${HPCRL_SLURM_NODES:-4}"
CPUS="${HPCRL_SLURM_CPUS:-4}"
MEM_MB="${HPCRL_SLURM_MEM_MB:-4000}"
GPUS="${HPCRL_SLURM_GPUS:-2}"
GRACE_S="${HPCRL_SLURM_GRACE_S:-10}"
STATE="${HPCRL_SLURM_STATE:-/var/lib/hpcrl-slurm}"
CTLD_PORT="${HPCRL_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT0="${HPCRL_SLURM_SLURMD_PORT0:-17001}"
TIMEOUT_S="${HPCRL_SLURM_TIMEOUT_S:-60}"
KICKER="${HPCRL_SLURM_KICKER:-1}"
ACCOUNTING="${HPCRL_SLURM_ACCOUNTING:-1}"
DB_PORT="${HPCRL_SLURM_DB_PORT:-3307}"
DBD_PORT="${HPCRL_SLURM_DBD_PORT:-6819}"
CONF_DIR=/etc/slurm
CLUSTER_NAME=hpcrllocal
export SLURM_CONF="$CONF_DIR/slurm.conf"

log() { echo "cluster.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

check_int() {  # name value min
  [[ "$2" =~ ^[0-9]+$ ]] && (( $2 >= $3 )) || die "$1=$2 is not an integer >= $3; set it to e.g. $(( $3 > 1 ? $3 : 1 ))"
}

validate_knobs() {
  check_int HPCRL_SLURM_NODES "$NODES" 1
  check_int HPCRL_SLURM_CPUS "$CPUS" 1
  check_int HPCRL_SLURM_MEM_MB "$MEM_MB" 100
  check_int HPCRL_SLURM_GPUS "$GPUS" 0
  check_int HPCRL_SLURM_GRACE_S "$GRACE_S" 0
  check_int HPCRL_SLURM_TIMEOUT_S "$TIMEOUT_S" 1
  check_int HPCRL_SLURM_CTLD_PORT "$CTLD_PORT" 1
  check_int HPCRL_SLURM_SLURMD_PORT0 "$SLURMD_PORT0" 1
  [[ "$ACCOUNTING" == 0 || "$ACCOUNTING" == 1 ]] || die "HPCRL_SLURM_ACCOUNTING=$ACCOUNTING must be 0 or 1"
  check_int HPCRL_SLURM_DB_PORT "$DB_PORT" 1
  check_int HPCRL_SLURM_DBD_PORT "$DBD_PORT" 1
  [[ "$STATE" == /* ]] || die "HPCRL_SLURM_STATE=$STATE must be an absolute path"
}

# A pid counts as alive unless it is gone or a zombie: on this VM exited daemons linger as <defunct>
# for seconds, and `kill -0` succeeds on them.
alive() {
  local pid="$1" st
  [[ -n "$pid" && -r "/proc/$pid/stat" ]] || return 1
  st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ -n "$st" && "$st" != Z ]]
}
pid_of() { [[ -s "$1" ]] && cat "$1" || true; }
node_names() { local i; for (( i = 1; i <= NODES; i++ )); do echo "n$i"; done; }
node_range() { if (( NODES == 1 )); then echo n1; else echo "n[1-$NODES]"; fi; }
port_range() {
  if (( NODES == 1 )); then echo "$SLURMD_PORT0"; else echo "[$SLURMD_PORT0-$(( SLURMD_PORT0 + NODES - 1 ))]"; fi
}

install_packages() {
  local missing=0 b pkgs=(slurmctld slurmd slurm-client munge) bins=(slurmctld slurmd sinfo munged)
  if (( ACCOUNTING )); then
    pkgs+=(slurmdbd slurm-wlm-mysql-plugin mariadb-server)
    bins+=(slurmdbd mariadbd mariadb-install-db)
    compgen -G "/usr/lib/*/slurm-wlm/accounting_storage_mysql.so" >/dev/null || missing=1
  fi
  for b in "${bins[@]}"; do command -v "$b" >/dev/null 2>&1 || [[ -x "/usr/sbin/$b" ]] || missing=1; done
  (( missing )) || return 0
  (( EUID == 0 )) || die "Slurm is not installed and installing needs root; run as root"
  command -v apt-get >/dev/null || die "Slurm is missing and apt-get is not available; install ${pkgs[*]} by hand"
  log "installing ${pkgs[*]} with apt (one-time)"
  # Debian's postinst scripts would try to start the services; policy-rc.d exit 101 forbids that
  # (there is no systemd here and the configs do not exist yet).
  local own_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own_policy=1
  fi
  local rc=0
  export DEBIAN_FRONTEND=noninteractive
  # Stale package lists give 404s; update only when the first try fails.
  apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"/tmp/hpcrl-slurm-apt.log" 2>&1 || {
    log "apt-get install failed; running apt-get update and retrying"
    apt-get update -q >>"/tmp/hpcrl-slurm-apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"/tmp/hpcrl-slurm-apt.log" 2>&1 || rc=$?
  }
  (( own_policy )) && rm -f /usr/sbin/policy-rc.d
  (( rc == 0 )) || { tail -n 30 /tmp/hpcrl-slurm-apt.log >&2; die "apt-get install ${pkgs[*]} failed (log: /tmp/hpcrl-slurm-apt.log)"; }
}

render_slurm_conf() {
  local gres_node=""
  (( GPUS > 0 )) && gres_node=" Gres=gpu:$GPUS"
  cat <<EOF
# written by hpcrl tests/slurm/cluster.sh - a local single-host test cluster; edits are overwritten
ClusterName=$CLUSTER_NAME
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job becomes eligible cred_expire+1 s after the requeue (default 120 s)
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT0
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# CR_CPU, not CR_CPU_Memory: a job without --mem would otherwise take the whole node's memory
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# no 3 s batch delay; backfill every 1 s; a full queue pass (restarts requeued jobs) every 2 s
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
$(accounting_lines)
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# lets a node claim more CPUs than the machine has
SlurmdParameters=config_overrides
# send the job's --signal (e.g. B:USR1) at preemption, not only before the time limit
SlurmctldParameters=preempt_send_user_signal
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
Waittime=0
SlurmctldDebug=info
SlurmdDebug=info
GresTypes=gpu
NodeName=$(node_range) NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(port_range) CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB$gres_node State=UNKNOWN
PartitionName=debug Nodes=$(node_range) Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_S
PartitionName=high Nodes=$(node_range) Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
}

accounting_lines() {
  if (( ACCOUNTING )); then
    printf '%s\n' "# job records go to slurmdbd (sacct); no limits or associations are enforced" \
      "AccountingStorageType=accounting_storage/slurmdbd" "AccountingStorageHost=localhost" \
      "AccountingStoragePort=$DBD_PORT"
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi
}

# slurmdbd's config; the database password only guards a MariaDB that listens on 127.0.0.1 for tests.
render_slurmdbd_conf() {
  cat <<EOF
# written by hpcrl tests/slurm/cluster.sh - accounting for the local test cluster; edits are overwritten
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=hpcrl-local-test
StorageLoc=slurm_acct_db
EOF
}

db_sql() { mariadb --no-defaults -S "$STATE/mysqlrun/mysqld.sock" -u root -e "$1"; }

# A private MariaDB (data dir and socket in the state dir, TCP on 127.0.0.1) and slurmdbd on it; the
# cluster is registered before slurmctld starts, so that slurmctld sends its job records there.
start_accounting() {
  if [[ ! -d "$STATE/mysql/mysql" ]]; then
    mkdir -p "$STATE/mysql"
    mariadb-install-db --no-defaults --datadir="$STATE/mysql" --user=root --auth-root-authentication-method=socket \
      --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 \
      || { tail -n 20 "$STATE/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  mkdir -p "$STATE/mysqlrun"
  rm -f "$STATE/mysqlrun/mysqld.sock"
  setsid mariadbd --no-defaults --datadir="$STATE/mysql" --socket="$STATE/mysqlrun/mysqld.sock" --port="$DB_PORT" \
    --bind-address=127.0.0.1 --user=root --pid-file="$STATE/run/mariadbd.pid" --log-error="$STATE/log/mariadbd.log" \
    --skip-name-resolve >>"$STATE/log/mariadbd.stdio" 2>&1 </dev/null &
  local i
  for (( i = 0; i < 100; i++ )); do db_sql "select 1" >/dev/null 2>&1 && break; sleep 0.1; done
  db_sql "select 1" >/dev/null 2>&1 || { print_logs; die "mariadbd did not start (log: $STATE/log/mariadbd.log)"; }
  db_sql "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'hpcrl-local-test';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "could not create slurmdbd's database user"
  slurmdbd >>"$STATE/log/slurmdbd.stdio" 2>&1 </dev/null || { print_logs; die "slurmdbd failed to start"; }
  for (( i = 0; i < 100; i++ )); do sacctmgr -n -P list cluster >/dev/null 2>&1 && break; sleep 0.1; done
  sacctmgr -n -P list cluster >/dev/null 2>&1 || { print_logs; die "slurmdbd does not answer (log: $STATE/log/slurmdbd.log)"; }
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
    sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null || die "sacctmgr add cluster $CLUSTER_NAME failed"
  fi
}

render_gres_conf() {
  echo "# written by hpcrl tests/slurm/cluster.sh - fake GPUs: files are symlinks to /dev/null"
  echo "AutoDetect=off"
  if (( GPUS > 0 )); then
    local files="$STATE/fakegpu/nvidia0"
    (( GPUS > 1 )) && files="$STATE/fakegpu/nvidia[0-$(( GPUS - 1 ))]"
    echo "NodeName=$(node_range) Name=gpu File=$files"
  fi
}

render_cgroup_conf() {
  # 22.05 has no CgroupPlugin=disabled; with proctrack/linuxproc and task/none nothing loads it.
  printf '%s\n' "# written by hpcrl tests/slurm/cluster.sh - cgroups are not used" \
    "CgroupPlugin=cgroup/v1" "ConstrainCores=no" "ConstrainRAMSpace=no" "ConstrainDevices=no"
}

write_kicker() {
  # A requeued hetjob is started only by the backfill scheduler, which runs only after some event;
  # on an idle test cluster nothing happens, so this loop makes a no-op partition update.
  cat > "$STATE/run/kicker.sh" <<EOF
#!/bin/bash
# written by hpcrl tests/slurm/cluster.sh: wakes the backfill scheduler while a hetjob is pending
echo \$\$ > "$STATE/run/kicker.pid"
export SLURM_CONF="$SLURM_CONF"
while sleep 3; do
  ctld=\$(cat "$STATE/run/slurmctld.pid" 2>/dev/null) || exit 0
  [[ -n "\$ctld" && -d /proc/\$ctld ]] || exit 0
  if squeue -h -t PD -o '%i' 2>/dev/null | grep -q '+'; then
    scontrol update PartitionName=debug State=UP >/dev/null 2>&1 || true
  fi
done
EOF
  chmod +x "$STATE/run/kicker.sh"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return 0; fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged >/dev/null 2>&1 </dev/null || true
  local i
  for (( i = 0; i < 50; i++ )); do munge_ok && break; sleep 0.1; done
  munge_ok || { tail -n 20 /var/log/munge/munged.log >&2 2>/dev/null || true; die "munged did not start"; }
  touch "$STATE/run/munged.ours"
}

# Every process whose environment says it belongs to a job of this cluster, plus every slurmstepd
# and its descendants. A crashed slurmd leaves these behind and they hold the ports and the CPUs.
job_pids() {
  local stepd_exe p exe
  stepd_exe=$(readlink -f /usr/sbin/slurmstepd 2>/dev/null || echo /usr/sbin/slurmstepd)
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [[ "$p" == "$$" || "$p" == "$BASHPID" ]] && continue
    exe=$(readlink "/proc/$p/exe" 2>/dev/null) || continue
    if [[ "$exe" == "$stepd_exe" ]]; then echo "$p"; continue; fi
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_CLUSTER_NAME=$CLUSTER_NAME"; then
      is_ancestor "$p" || echo "$p"
    fi
  done
}
is_ancestor() {  # is $1 this script or one of its ancestors (never kill the caller)
  local cur=$$
  while [[ -n "$cur" && "$cur" != 0 && "$cur" != 1 ]]; do
    [[ "$cur" == "$1" ]] && return 0
    cur=$(awk '{print $4}' "/proc/$cur/stat" 2>/dev/null) || return 1
  done
  return 1
}

kill_orphans() {
  local pids
  pids=$(job_pids | tr '\n' ' ')
  [[ -z "${pids// }" ]] && return 0
  log "killing leftover job processes: $pids"
  kill -KILL $pids 2>/dev/null || true
}

wait_gone() {  # deadline_s pid...
  local deadline=$(( SECONDS + $1 )) p any; shift
  while (( SECONDS < deadline )); do
    any=0; for p in "$@"; do alive "$p" && any=1; done
    (( any )) || return 0
    sleep 0.1
  done
  return 1
}

daemon_pids() {
  local n
  pid_of "$STATE/run/slurmctld.pid"
  pid_of "$STATE/run/slurmdbd.pid"
  pid_of "$STATE/run/mariadbd.pid"
  for n in $(node_names); do pid_of "$STATE/run/slurmd-$n.pid"; done
}

running_complete() {  # every daemon of the current config is alive
  local p
  alive "$(pid_of "$STATE/run/slurmctld.pid")" || return 1
  for n in $(node_names); do alive "$(pid_of "$STATE/run/slurmd-$n.pid")" || return 1; done
  if (( ACCOUNTING )); then
    alive "$(pid_of "$STATE/run/slurmdbd.pid")" && alive "$(pid_of "$STATE/run/mariadbd.pid")" || return 1
  fi
  munge_ok
}
any_running() {
  local p
  for p in $(daemon_pids) $(pid_of "$STATE/run/kicker.pid"); do alive "$p" && return 0; done
  # pid files of nodes that an older config had
  for p in "$STATE"/run/slurmd-*.pid; do [[ -e "$p" ]] && alive "$(pid_of "$p")" && return 0; done
  return 1
}

print_logs() {
  local f
  for f in "$STATE"/log/*.log; do
    [[ -e "$f" ]] || continue
    echo "----- $f (last 25 lines) -----" >&2
    tail -n 25 "$f" >&2
  done
}

wait_idle() {
  local deadline=$(( SECONDS + TIMEOUT_S )) states
  while (( SECONDS < deadline )); do
    states=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | sort -u || true)
    if [[ -n "$states" ]] && (( $(grep -c ' idle$' <<<"$states") == NODES )); then return 0; fi
    sleep 0.2
  done
  log "nodes not idle after ${TIMEOUT_S}s; sinfo says:"
  sinfo -N -p debug 2>&1 >&2 || true
  print_logs
  return 1
}

cmd_start() {
  validate_knobs
  (( EUID == 0 )) || die "must run as root (the daemons run as root and the configs live in $CONF_DIR)"
  install_packages
  mkdir -p "$STATE/run"
  local tmp; tmp=$(mktemp -d)
  render_slurm_conf > "$tmp/slurm.conf"; render_gres_conf > "$tmp/gres.conf"; render_cgroup_conf > "$tmp/cgroup.conf"
  render_slurmdbd_conf > "$tmp/slurmdbd.conf"
  if running_complete && cmp -s "$tmp/slurm.conf" "$CONF_DIR/slurm.conf" && cmp -s "$tmp/gres.conf" "$CONF_DIR/gres.conf" \
      && { (( ! ACCOUNTING )) || cmp -s "$tmp/slurmdbd.conf" "$CONF_DIR/slurmdbd.conf"; }; then
    rm -rf "$tmp"
    if wait_idle_quick; then log "already running with this configuration; nothing to do"; return 0; fi
    log "daemons are up but nodes are not idle; restarting"
  fi
  if any_running; then log "stopping the running cluster first (configuration changed or incomplete)"; cmd_stop; fi
  kill_orphans
  local t0=$SECONDS
  mkdir -p "$CONF_DIR" "$STATE"/{ctld,log,run,fakegpu}
  local n i
  for n in $(node_names); do mkdir -p "$STATE/slurmd-$n"; done
  for (( i = 0; i < GPUS; i++ )); do ln -sfn /dev/null "$STATE/fakegpu/nvidia$i"; done
  install -m 0644 "$tmp/slurm.conf" "$tmp/gres.conf" "$tmp/cgroup.conf" "$CONF_DIR/"
  install -m 0600 "$tmp/slurmdbd.conf" "$CONF_DIR/"  # slurmdbd refuses a config that others can read
  rm -rf "$tmp"
  start_munge
  if (( ACCOUNTING )); then start_accounting; fi
  # Daemon stdio goes to files so that a caller capturing our output is not held open by the daemons.
  slurmctld >>"$STATE/log/slurmctld.stdio" 2>&1 </dev/null || { print_logs; die "slurmctld failed to start"; }
  for n in $(node_names); do
    slurmd -N "$n" >>"$STATE/log/slurmd-$n.stdio" 2>&1 </dev/null || { print_logs; die "slurmd -N $n failed to start"; }
  done
  if (( KICKER )); then
    write_kicker
    setsid "$STATE/run/kicker.sh" >/dev/null 2>&1 </dev/null &
  fi
  # Jobs left over in the saved state by a crashed instance would be requeued and run again.
  local stale; stale=$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
  if [[ -n "${stale// }" ]]; then log "cancelling jobs left from a previous instance: $stale"; scancel $stale 2>/dev/null || true; fi
  wait_idle || die "cluster did not become idle; see the logs above (state: $STATE)"
  local acct="no accounting"
  (( ACCOUNTING )) && acct="accounting (sacct)"
  log "up: $NODES nodes x $CPUS CPUs, $GPUS fake GPUs each, partitions debug (preemptable) and high, $acct;" \
    "$(( SECONDS - t0 ))s"
}

wait_idle_quick() {
  local states; states=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | sort -u || true)
  [[ -n "$states" ]] && ! grep -Eq ' (down|drain|fail|unk)[*~#%!$@^-]*$|\*$' <<<"$states"
}

cmd_stop() {
  local wipe=0
  [[ "${1:-}" == "--wipe" ]] && wipe=1
  local kick; kick=$(pid_of "$STATE/run/kicker.pid")
  alive "$kick" && kill -TERM "$kick" 2>/dev/null || true
  local pids=() p f
  for f in "$STATE"/run/slurmctld.pid "$STATE"/run/slurmd-*.pid; do
    [[ -e "$f" ]] || continue
    p=$(pid_of "$f")
    if alive "$p"; then pids+=("$p"); fi
  done
  if alive "$(pid_of "$STATE/run/slurmctld.pid")"; then
    local jobs; jobs=$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
    if [[ -n "${jobs// }" ]]; then
      scancel $jobs 2>/dev/null || true
      local deadline=$(( SECONDS + 10 ))
      while (( SECONDS < deadline )) && [[ -n "$(squeue -h -o '%A' 2>/dev/null)" ]]; do sleep 0.2; done
    fi
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  if (( ${#pids[@]} )); then
    wait_gone 5 "${pids[@]}" || { kill -TERM "${pids[@]}" 2>/dev/null || true; wait_gone 3 "${pids[@]}" || kill -KILL "${pids[@]}" 2>/dev/null || true; }
  fi
  kill_orphans
  local dbpids=()
  for f in "$STATE"/run/slurmdbd.pid "$STATE"/run/mariadbd.pid; do
    p=$(pid_of "$f")
    if alive "$p"; then kill -TERM "$p" 2>/dev/null || true; dbpids+=("$p"); fi
  done
  if (( ${#dbpids[@]} )); then wait_gone 10 "${dbpids[@]}" || kill -KILL "${dbpids[@]}" 2>/dev/null || true; fi
  if [[ -e "$STATE/run/munged.ours" ]]; then
    local mp; mp=$(pid_of /run/munge/munged.pid)
    if alive "$mp"; then kill -TERM "$mp" 2>/dev/null || true; wait_gone 3 "$mp" || kill -KILL "$mp" 2>/dev/null || true; fi
    rm -f "$STATE/run/munged.ours"
  fi
  rm -f "$STATE"/run/*.pid
  if (( wipe )); then rm -rf "$STATE"; log "stopped and wiped $STATE"; else log "stopped"; fi
}

cmd_status() {
  validate_knobs
  local p n rc=0
  p=$(pid_of "$STATE/run/slurmctld.pid")
  if alive "$p"; then echo "slurmctld: running (pid $p)"; else echo "slurmctld: not running"; rc=1; fi
  for n in $(node_names); do
    p=$(pid_of "$STATE/run/slurmd-$n.pid")
    if alive "$p"; then echo "slurmd $n: running (pid $p)"; else echo "slurmd $n: not running"; rc=1; fi
  done
  if munge_ok; then echo "munge: ok"; else echo "munge: not working"; rc=1; fi
  p=$(pid_of "$STATE/run/kicker.pid")
  if alive "$p"; then echo "kicker: running (pid $p)"; else echo "kicker: not running"; fi
  if (( ACCOUNTING )); then
    for n in slurmdbd mariadbd; do
      p=$(pid_of "$STATE/run/$n.pid")
      if alive "$p"; then echo "$n: running (pid $p)"; else echo "$n: not running"; rc=1; fi
    done
  fi
  if (( rc == 0 )); then
    sinfo -N || rc=1
    squeue || rc=1
    wait_idle_quick || { echo "some nodes are down, drained or unresponsive"; rc=1; }
  fi
  return "$rc"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) shift; cmd_stop "$@" ;;
  restart) cmd_stop; cmd_start ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop [--wipe]|restart|status   (knobs: see the header of this file)" >&2; exit 2 ;;
esac
