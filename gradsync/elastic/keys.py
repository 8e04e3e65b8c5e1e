"""Every key gradsync.elastic keeps in the job's store (a TCPStore, or under ``gradsync/<job>/`` on etcd), in one
place: who writes it, who reads it, and how long it lives. All live under ``gradsync/elastic/``; per-round keys
under ``round<k>/``, so a round's keys never meet another's. Nothing is written per step: the store holds a few
keys per worker and per round, however long the job.

=====================================  ====================================================  =====================
key                                    meaning                                               written by
=====================================  ====================================================  =====================
``sequence``                           counter: each worker's number, taken on arrival       every worker, once
``worker/<launcher's name>``           that worker's number, for its launcher's exit report  every worker, once
``beat/<member>``                      heartbeat counter; -1: its launcher saw it exit       its thread, launchers
``exited/<member>``                    its launcher saw its process exit                     launchers
``lost/<member>``                      its heartbeat stopped: the count last seen, and why   the member watching it
``suspected/<member>``                 its heartbeat stood still for 3 beats: count, why     the member watching it
``stalled/<member>``                   its training thread is outside every collective past  its own heartbeat
                                       the collective timeout (why); deleted once back       thread
``pace/<member>``                      the share of its last 10 s spent outside collectives  its own heartbeat
                                                                                             thread
``verdicts``, ``verdicts/<k>``         counter: marks posted; the k-th mark's member        launchers, watchers,
                                                                                             stalled members
``joiners/<member>``, ``join_requests``  a worker asks to be admitted; how many asked so far  joiners
``tickets/<k>``                        the worker that made the k-th join request            joiners
``joined/<member>``                    admitted ("expired: why" if left out)                 members / leaders
``current_round``                      the number of the last round formed                   round leaders
``round<k>/registered/<member>``       the member's committed steps, registering for k       members
``round<k>/leader``                    who decides round k (compare_set)                     the first to register
``round<k>/members``                   round k's members, JSON, in rank order                round k's leader
``round<k>/requests``                  join requests counted when round k formed             round k's leader
``round<k>/verdicts``                  verdicts counted when round k formed                 round k's leader
``round<k>/committed``                 the steps round k's rank 0 had committed as it formed  round k's leader
``round<k>/admit_at``                  the step at whose boundary round k admits joiners     round k's rank 0
``round<k>/arrived``                   counter: members at round k's formation gate          members
``round<k>/gate``                      "open", or why round k was called off (compare_set)   the last in, watchers
``round<k>/group/...``                 round k's process group (torch's own keys)            torch
``done``, ``finished``                 the members finished; how many did                    members
``state_lost``                         why no worker holds the job's state any more          a joiner or a leader
``connect_slowest``                    the slowest group connect a member measured (s)       members
=====================================  ====================================================  =====================
"""

from __future__ import annotations

PREFIX = "gradsync/elastic/"
# Not a key: the environment variable the launcher sets on a worker it restarted, so that it asks to join.
REJOIN_VARIABLE = "GRADSYNC_ELASTIC_REJOIN"

SEQUENCE = PREFIX + "sequence"
CURRENT_ROUND = PREFIX + "current_round"
JOIN_REQUESTS = PREFIX + "join_requests"
DONE = PREFIX + "done"
EXITED_BEAT = -1  # beat/<member>'s value once its launcher saw it exit (verdicts.mark_exited)
FINISHED = PREFIX + "finished"
STATE_LOST = PREFIX + "state_lost"
CONNECT_SLOWEST = PREFIX + "connect_slowest"
VERDICTS = PREFIX + "verdicts"


def worker(name: str) -> str:
    return f"{PREFIX}worker/{name}"


def beat(member: int) -> str:
    return f"{PREFIX}beat/{member}"


def exited(member: int) -> str:
    return f"{PREFIX}exited/{member}"


def lost(member: int) -> str:
    return f"{PREFIX}lost/{member}"


def suspected(member: int) -> str:
    return f"{PREFIX}suspected/{member}"


def stalled(member: int) -> str:
    return f"{PREFIX}stalled/{member}"


def pace(member: int) -> str:
    return f"{PREFIX}pace/{member}"


def verdict(ticket: int) -> str:
    return f"{PREFIX}verdicts/{ticket}"


def joiner(member: int) -> str:
    return f"{PREFIX}joiners/{member}"


def ticket(request: int) -> str:
    return f"{PREFIX}tickets/{request}"


def joined(member: int) -> str:
    return f"{PREFIX}joined/{member}"


def registered(round_number: int, member: int) -> str:
    return f"{PREFIX}round{round_number}/registered/{member}"


def leader(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/leader"


def members(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/members"


def verdicts_counted(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/verdicts"


def committed(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/committed"


def requests(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/requests"


def admit_at(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/admit_at"


def arrived(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/arrived"


def gate(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/gate"


def group_prefix(round_number: int) -> str:
    return f"{PREFIX}round{round_number}/group/"
