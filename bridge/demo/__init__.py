"""Demo: one command that sets up and runs the pipeline on this machine."""
