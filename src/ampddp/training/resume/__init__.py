"""Resume policy, apart from the checkpoint format: which checkpoint a run continues from and which
newer folders it sets aside (``source``), which setting changes a resume accepts (``changes``), and
how a changed learning rate, horizon or optimizer carries into the resumed run (``schedule_plan``).
``ampddp.checkpoint`` only stores, verifies and finds checkpoints; the Checkpointer and the recipe's
pre-start checks ask this package what a resume may do."""

from ampddp.training.resume.changes import check_resume_settings, config_changes
from ampddp.training.resume.schedule_plan import SchedulePlan, plan_schedule
from ampddp.training.resume.source import plan_resume, resume_candidates, set_aside_newer

__all__ = [
    "SchedulePlan",
    "check_resume_settings",
    "config_changes",
    "plan_resume",
    "plan_schedule",
    "resume_candidates",
    "set_aside_newer",
]
