"""MegaDPP: dynamic pipeline planning. Each rank runs, at every step, the highest-priority task
whose inputs have arrived (policies dfc / bfc / adaptive), over asynchronous P2P."""
