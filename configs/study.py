# The long-context study's model (make compare): 6 layers of width 384, 6 heads of 64 (10.7M parameters), dropout
# 0.1, compiled (torch.compile roughly doubles this launch-bound size's tokens/s). compare.py sets each run's
# attention, short_conv, context, batch, steps (its budget: --epochs passes over the train split), rate and seed,
# and keeps its best-val checkpoint (docs/study.md).
attention = "softmax"
n_layer = 6
n_head = 6
n_embd = 384
seq_len = 1024
dropout = 0.1
batch_size = 16
max_iters = 1000
warmup_iters = 100
lr = 2e-3
min_lr = 2e-4
weight_decay = 0.1
eval_interval = 250
eval_max_windows = 16
sample_tokens = 0
ckpt_interval = 250
dtype = "auto"
compile = True
