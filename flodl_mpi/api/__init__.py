"""The Python API: :func:`fit` (the trainer loop) and :class:`Averager` (your own loop).
"""
