"""The commands of `ckptkit`, one module each; cli/main.py adds every one of ALL to its group."""

from .consolidate import consolidate
from .convert import convert
from .demo import demo
from .diff import diff
from .inspect import inspect
from .plan import plan
from .reshard import reshard
from .verify import verify

ALL = (inspect, verify, consolidate, reshard, convert, diff, demo, plan)
