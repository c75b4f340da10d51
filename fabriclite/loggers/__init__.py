"""Loggers: where ``fabric.log`` and ``fabric.log_dict`` send metrics.

Importing this package stays cheap: tensorboard and yaml are imported by the methods that use them.

Usage::

    from fabriclite.loggers import CSVLogger, TensorBoardLogger
    fabric = Fabric(loggers=[CSVLogger("logs"), TensorBoardLogger("logs")])
"""

from fabriclite.loggers.base import Logger, LoggerError
from fabriclite.loggers.csv_logs import CSVLogger
from fabriclite.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "LoggerError", "TensorBoardLogger"]
