"""A transformers ``Trainer`` run on a tiny GPT-2 built from a config, on generated tokens: nothing downloaded.
The Trainer reads the torchrun variables itself (through Accelerate) and wraps the model in DDP on gloo.

Usage: torchrun --nproc-per-node 2 hf_trainer.py OUT_DIR [SEED]
"""

import sys
import tempfile

import torch
from _report import finished, record_pid, report
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(Dataset):
    def __init__(self, size: int, length: int, vocab: int, seed: int):
        self.ids = torch.randint(0, vocab, (size, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LastLossTrainer(Trainer):
    """Keeps this rank's own loss of the last step (the Trainer logs the mean over the ranks)."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        self.last_local_loss = (out[0] if return_outputs else out).item()
        return out


def main(out_dir: str, seed: int) -> None:
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            max_steps=4,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            seed=seed,
            disable_tqdm=True,
        )
        trainer = LastLossTrainer(model=model, args=args, train_dataset=RandomTokens(64, 16, config.vocab_size, seed))
        record_pid(out_dir)
        result = trainer.train()
    report(out_dir, result.training_loss, trainer.last_local_loss, model)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    finished(sys.argv[1])
