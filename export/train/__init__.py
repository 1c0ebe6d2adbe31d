"""Training the heads that draft for a target (Medusa, EAGLE) on its own outputs: torch, like the rest of export/."""
