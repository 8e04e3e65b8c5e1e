"""The launchers, the top floor: ``gradsync run`` (:mod:`.run`) and its c10d rendezvous (:mod:`.rendezvous`),
``--elastic`` (:mod:`.elastic`) and the launcher's side of ``--watchdog`` (:mod:`.watchdog`). They start and
supervise processes (torch elastic), pick ports, restart workers; the library below them never imports them."""
