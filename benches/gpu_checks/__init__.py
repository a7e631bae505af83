"""The checks of ``benches/gpu_check.py``, one file per concern; ``common`` holds what they share."""
