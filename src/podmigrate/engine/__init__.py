"""The migration engine: a controller that runs one migration as a persisted state machine.

``record`` stores migration records (SQLite in the lab); ``blackout`` turns probe logs into the
blackout figure; ``controller`` holds the phases, their rollbacks and crash recovery.
"""
