"""Drop-in interfaces of other MoE communication libraries over EPX.

``import epx.compat.deep_ep as deep_ep`` gives DeepEP V1's Buffer, Config and EventOverlap.
"""
