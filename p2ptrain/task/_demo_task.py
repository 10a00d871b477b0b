"""The demo's task: a small MLP on scikit-learn's digits, top-k gradients with error feedback.

``p2ptrain demo`` publishes it; tests and benches train it too, as the smallest real task
(seconds per run on a CPU). A ``str.format`` template: ``manifest`` (dataset CID), ``steps``,
``checkpoint`` (interval), ``density`` and ``peers`` (most members).
"""

TASK_TEMPLATE = """\
name = "demo-digits-mlp"
seed = 0

[model]
name = "mlp"
kwargs = {{ in_features = 64, hidden = [64], out_features = 10 }}

[dataset]
manifest = "{manifest}"

[optimizer]
name = "adam"
lr = 0.02

[schedule]
name = "cosine"
warmup_steps = 10
min_lr_ratio = 0.1

[training]
batch_size = 32
total_steps = {steps}
checkpoint_interval = {checkpoint}

[compression]
density = {density}
error_feedback = true

[peers]
min = 2
max = {peers}
"""
