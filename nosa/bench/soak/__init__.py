"""The soak (scripts/soak.py): ``client`` (loopback HTTP), ``checks`` (malformed list, probes, burst,
idle accounting, RSS), ``load`` (the mixed load), ``run`` (the whole soak and its report)."""
