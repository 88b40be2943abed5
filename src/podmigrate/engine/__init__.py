"""The migration engine: one migration as a persisted state machine, in the lab and on Kubernetes.

Start at ``plans`` (the table of which phases each kind of migration runs), then ``runner`` (how
they run, undo and resume); ``phases`` holds the lab's phases and ``controller`` the lab's entry
points (``migrate``, ``recover``); ``record`` documents every field of a record; ``summary`` and
``blackout`` turn measurements into figures; ``gc`` finds what failed runs left.
"""
