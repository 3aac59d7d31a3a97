"""The rollout system: `Sample`, the unit it generates and trains on; the data source that hands out prompt groups
after the buffered ones; rollout dumps."""

from baton.rollout.data_source import RolloutDataSource, sample_seed, take_first
from baton.rollout.dump import load_rollout, save_rollout
from baton.rollout.sample import Sample, Status, samples_to_data

__all__ = ["RolloutDataSource", "Sample", "Status", "load_rollout", "sample_seed", "samples_to_data", "save_rollout",
           "take_first"]
