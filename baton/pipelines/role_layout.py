"""The roles of a pipeline config and what they ask for: which hold a model, which take devices, how many device slots
per node they need, and the one-line description that layout errors quote. Read by the pipeline before it reserves
(`base`) and by the checks that run before Ray starts (`preflight`)."""

from __future__ import annotations

from baton.pipelines.config import MODEL_ROLES, RoleConfig, WorkerSettings


def model_roles(config) -> dict[str, RoleConfig]:
    """The config's roles that hold a model, by name."""
    return {name: role for name in MODEL_ROLES if isinstance(role := getattr(config, name, None), RoleConfig)}


def device_roles(config) -> dict[str, WorkerSettings]:
    """The config's roles whose workers take devices, by name."""
    return {name: value for name, value in vars(config).items()
            if isinstance(value, WorkerSettings) and value.num_devices_per_worker > 0}


def devices_needed(config, num_nodes: int = 1) -> int:
    """Device slots per node that the config's roles ask for: (highest device id + 1) over the nodes; at least 1."""
    total = 1
    for name, role in device_roles(config).items():
        count = role.num_workers(name) * role.num_devices_per_worker
        total = max(total, max(role.device_mapping) + 1 if role.device_mapping else count)
    return -(-total // num_nodes)


def describe_roles(config) -> str:
    return ", ".join(f"{name}: {role.num_workers(name)} worker(s) × {role.num_devices_per_worker} device(s)"
                     + (f" on devices {role.device_mapping}" if role.device_mapping else "")
                     for name, role in device_roles(config).items())
