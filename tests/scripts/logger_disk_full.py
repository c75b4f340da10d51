"""On a 1 MB file system (a tmpfs the test mounts) filled by another file: CSVLogger rows that cannot be written
raise an error naming the file and stay buffered; once space is freed, the next save writes every row exactly once.
Prints "PASS disk full".

Usage: `python logger_disk_full.py DISK`.
"""

import csv
import os
import sys
from pathlib import Path

from fabriclite.loggers import CSVLogger

disk = Path(sys.argv[1])
logger = CSVLogger(disk, name="run", version=0, flush_logs_every_n_steps=50)
filler = disk / "filler"
fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
try:  # fill the disk
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    pass
finally:
    os.close(fd)
os.truncate(filler, os.path.getsize(filler) - 3 * 4096)  # leave about 12 KB
rows, error = 0, None
while error is None and rows < 100000:
    try:
        logger.log_metrics({"loss": 1.0 / (rows + 1), "accuracy_of_a_long_named_metric": rows * 0.001}, step=rows)
        rows += 1
    except OSError as err:
        error = err
        rows += 1  # the row that raised is buffered too
assert error is not None, "the disk never filled"
message = str(error)
assert "No space left on device" in message and "metrics.csv" in message and "stay buffered" in message, message
filler.unlink()
logger.save()
with open(disk / "run" / "version_0" / "metrics.csv") as file:
    written = [int(row["step"]) for row in csv.DictReader(file)]
assert written == list(range(rows)), (len(written), rows, written[-3:])
print("PASS disk full", flush=True)
