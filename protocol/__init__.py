"""The wire contract of mmlane: messages, the frame codec and the error tree.

Imports nothing from `services/`; every role meets the others only through this package.
"""
