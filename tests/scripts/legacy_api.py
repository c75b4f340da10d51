"""Lightning Fabric's older pattern: a Fabric subclass whose run() holds the training; calling it launches.
Run as `python legacy_api.py STRATEGY`; prints "PASS <rank> <name>" per check."""

import os
import sys

import torch

from fabriclite import Fabric


class Trainer(Fabric):
    def run(self, value, scale=1):
        total = self.all_reduce(torch.tensor(float(self.global_rank + value) * scale), reduce_op="sum")
        ok = self.world_size == 2 and total.item() == (2 * value + 1) * scale and type(self) is Trainer
        os.write(1, f"{'PASS' if ok else 'FAIL'} {self.global_rank} run of a Fabric subclass launched\n".encode())
        return total.item()


if __name__ == "__main__":
    result = Trainer(accelerator="cpu", devices=2, strategy=sys.argv[1]).run(3, scale=2)
    os.write(1, f"DONE result={result}\n".encode())
