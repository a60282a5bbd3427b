"""The lowest layer: the batch every stage passes on, loss aggregation, memory accounting and the user-facing errors.

Nothing here imports another part of posttrain.
"""
