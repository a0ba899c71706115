# The associative-recall probe (data/recall.py: Zoology's MQAR in bytes) on one GPU, about a minute a run:
# does an attention find the value of each queried key among 16 key-value pairs in 256 bytes?
#   python train.py --config configs/recall --attention softmax                          # the reference
#   python train.py --config configs/recall --attention fastmax --use-cuda-kernel --seq_len 1024 --recall_pairs 64
# Read val/accuracy and test/accuracy: chance is 1/128; about 1/recall_pairs means the model only learned to
# pick among the values in the sequence, not which one belongs to the key.
task = "recall"
recall_pairs = 16
attention = "softmax"
# Zoology's recall models: 2 layers, a short convolution ahead of attention. Without it attention must first
# discover a previous-token head (a value must carry the key before it), which a 2-layer model takes far longer
# to find than the recall itself; with it softmax learns 16 pairs within 400-2,400 steps at rates 3e-4 to 3e-3
# (bench/runs/2026-12-02_s51_recall-probe-softmax-h200.txt).
n_layer = 2
n_head = 2
n_embd = 128
short_conv = 3
seq_len = 256
dropout = 0.0
batch_size = 64
max_iters = 5000
warmup_iters = 250
lr = 3e-3
min_lr = 3e-4
weight_decay = 0.0  # every batch is fresh sequences: there is nothing to overfit
eval_interval = 500
eval_max_windows = 256
sample_tokens = 0
ckpt_interval = 1000
dtype = "auto"
