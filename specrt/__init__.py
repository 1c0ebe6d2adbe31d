"""specrt: exact speculative decoding, compiled."""
