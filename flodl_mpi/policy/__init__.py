"""When a round fires and who trains how much: the averaging policies, ElChe, cadence plans, replay.
"""
