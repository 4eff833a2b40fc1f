"""Benchmarks of ckptstore side by side with torch.save, safetensors and DCP (``make bench``).

Not part of the installed package: run the scripts directly, e.g.
``python benchmarks/run_all.py --quick``.
"""
