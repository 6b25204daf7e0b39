"""Sokoban: seeded reverse-play rooms, an exact solver, and deadlock feedback (``envs.sokoban.env``)."""
