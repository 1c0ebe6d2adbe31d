"""specrt.build."""
