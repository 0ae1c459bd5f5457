"""``mlafx bench e2e``: end-to-end prefill, decode and serving figures of mlafx's compiled
step against its reference path, transformers' eager model and ``torch.compile`` of it, all
on the same weights in one run (entry point: ``bench/e2e/main.py``)."""
