"""specrt.export."""
