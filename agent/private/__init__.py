"""Worker-private state: registration, swapping to host under a device budget, saving for a resize."""
