"""What the launcher's fork server imports before it forks any rank (launch.rank_processes): the rank's code,
and torch with it, once for every rank it forks; and the parent-death signal, so that the server dies with the
launcher even by SIGKILL, and every rank it forked with the server (ending.die_with_parent), a stopped one too.
A rank forked while the launcher was interrupted finds its start data cut short (EOFError before any of its code
runs): it leaves quietly, as the launcher has stopped waiting for it.
Imported only by the fork server: importing it anywhere else would tie that process to its parent."""

import os
import sys

from . import rank  # noqa: F401 - imported for the ranks this server forks
from .ending import die_with_parent


def _quiet_when_cut_short(kind, value, tb, print_it=sys.excepthook) -> None:
    if not issubclass(kind, EOFError):
        print_it(kind, value, tb)


die_with_parent(os.getppid())
sys.excepthook = _quiet_when_cut_short
