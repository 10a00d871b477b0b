"""What the pipeline tests share: a task of a transformer_lm small enough to cut and plan quickly."""

from __future__ import annotations

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
LM = {"vocab_size": 61, "context": 16, "width": 16, "depth": 2, "heads": 2}  # 4 pieces
LM_TASK = f"""
name = "t"
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }}
[dataset]
manifest = "{CID}"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = 8
total_steps = 10
[peers]
min = 4
"""
