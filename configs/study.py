# The long-context study's model (make compare): 6 layers of width 384, 6 heads of 64 (10.7M parameters),
# a size the 4 MB enwik8 prefix does not simply memorise in the study's budget (the report shows the
# train/val gap). compare.py sets the context, batch, steps, learning rate and seed of each run.
attention = "softmax"
n_layer = 6
n_head = 6
n_embd = 384
seq_len = 1024
dropout = 0.0
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
