#!/bin/bash
# Train on the GPUs of one Slurm node: torchrun inside the Apptainer image that container.def builds.
# Untested: written where neither Slurm nor Apptainer exists. Add the partition/account your cluster
# needs; the flags after the script's name go to train.py.
#
#   apptainer build attention-gpt.sif container.def                          # once, from the repository root
#   apptainer exec attention-gpt.sif python -m data --cache-dir enwik8-cache # once: fetch and verify enwik8
#   sbatch scripts/slurm_train.sh --use-cuda-kernel                          # configs/base: cosine, our kernels
#   sbatch --gpus-per-node=8 scripts/slurm_train.sh --attention softmax      # the SDPA baseline on 8 GPUs
#   SIF=/path/to/attention-gpt.sif DATA=/path/to/enwik8 sbatch scripts/slurm_train.sh --config configs/long
#
# grad_accum_steps counts the micro-steps of all GPUs together (a multiple of their number), so it is
# set to the GPU count here: a step of configs/base then holds batch_size x GPUs sequences. Give
# --grad_accum_steps N to choose another multiple. The job resumes from out/<run_name>/ckpt.pt when it
# exists (--resume auto), so resubmitting or requeueing continues the run.
#
#SBATCH --job-name=enwik8-attention
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@180
#SBATCH --output=%x-%j.out
# One task: torchrun starts one process per GPU itself. SIGTERM 3 minutes before the time limit makes
# every rank finish its step and rank 0 write a checkpoint (train.py exits 130).
set -euo pipefail

SIF=${SIF:-attention-gpt.sif}
DATA=${DATA:-enwik8-cache/enwik8}
NGPUS=${SLURM_GPUS_ON_NODE:-1}
# Compute nodes are often offline: log to wandb offline and `wandb sync wandb/offline-run-*` later.
export WANDB_MODE=${WANDB_MODE:-offline}

srun apptainer exec --nv --bind "$PWD" --bind "$(dirname "$(realpath "$DATA")")" "$SIF" \
    torchrun --standalone --nproc_per_node="$NGPUS" /opt/project/train.py \
    --data-path "$DATA" --grad_accum_steps "$NGPUS" --resume auto "$@"
