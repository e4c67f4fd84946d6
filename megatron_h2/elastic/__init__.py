"""Elastic training: the launcher that restarts a job on the chips that are left
(:mod:`.launcher`) with a plan re-made for them (:mod:`.replan`)."""
