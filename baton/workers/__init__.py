"""Role workers: each a `Worker` whose `@register` methods the pipelines call."""

from baton.workers.model import ModelWorker
from baton.workers.roles import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker, TeacherWorker

__all__ = ["ActorWorker", "CriticWorker", "ModelWorker", "ReferenceWorker", "RewardWorker", "RolloutWorker",
           "TeacherWorker"]
