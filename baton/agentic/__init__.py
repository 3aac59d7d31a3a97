"""Multi-turn RL: environments, the worker processes they run in, and trajectories on the rollout system. The names
load on first use, so an environment process imports only what it runs."""

from baton._lazy import lazy_exports

_EXPORTS = {
    "ENVIRONMENTS": "baton.agentic.env", "Env": "baton.agentic.env", "GuessNumberEnv": "baton.agentic.env",
    "CalculatorEnv": "baton.agentic.env",
    "EnvError": "baton.agentic.pool", "EnvPool": "baton.agentic.pool",
    "AgenticSettings": "baton.agentic.rollout", "generate_trajectory": "baton.agentic.rollout",
    "trajectory_reward": "baton.agentic.rollout",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
