"""``shardfmt demo``: a small training job that crashes and resumes bit for bit (not library code)."""
