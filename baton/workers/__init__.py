"""Role workers: each a `Worker` whose `@register` methods the pipelines call."""

from baton.workers.model import ModelWorker
from baton.workers.roles import ActorWorker, BaseModelReference, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker, TeacherWorker

__all__ = ["ActorWorker", "BaseModelReference", "CriticWorker", "ModelWorker", "ReferenceWorker", "RewardWorker", "RolloutWorker",
           "TeacherWorker"]
