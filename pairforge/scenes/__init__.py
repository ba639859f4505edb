"""The scene world: procedural scenes with exact captions, web-like alt-text, a judge.

``world`` makes scenes and their captions, ``corrupt`` the noisy alt-text, ``judge`` reads
an image back into the caption's attributes, ``captioner`` trains the world's captioner and
``evaluate`` measures a trained run (prompt adherence, caption accuracy).
"""
