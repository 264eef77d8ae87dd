"""Differential-privacy building blocks (:mod:`.mechanisms`) and accounting (:mod:`.accounting`)."""
