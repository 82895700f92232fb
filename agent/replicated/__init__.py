"""Replicated state: one copy per device of a model, its optimizer and scheduler, shared by the hosted workers."""
