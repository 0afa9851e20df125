"""Job configuration: the typed schema of a job YAML file, its loader and its validation.

    job = load_job("job.yaml", ["algorithm.lr=3e-4"])   # parse, type, resolve paths, validate
    yaml.safe_dump(to_dict(job))                          # the resolved config, loadable again
"""

from hpcrl.config.errors import ConfigError
from hpcrl.config.load import apply_overrides, job_from_dict, load_job, to_dict, valid_keys
from hpcrl.config.schema import (AlgorithmConfig, CheckpointConfig, DataConfig, JobConfig, LoggingConfig,
                                 ModelConfig, ResourcesConfig, RewardConfig, RolloutConfig, TrainerConfig)
from hpcrl.config.validate import validate

__all__ = ["AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "JobConfig", "LoggingConfig",
           "ModelConfig", "ResourcesConfig", "RewardConfig", "RolloutConfig", "TrainerConfig",
           "apply_overrides", "job_from_dict", "load_job", "to_dict", "valid_keys", "validate"]
