"""On-disk parts of the G3 (SSD) tier; the tier itself is ``kvstore.ssd_tier.SSDTier``."""
