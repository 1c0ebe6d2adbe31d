"""What the GPU backends share: device memory over cuda-bindings (memory.py), the geometry and checks of an engine
of the portable graph (geometry.py), the batch engine on the device (batch.py) and the EAGLE head there (eagle.py)."""
