"""The dashboard's pushed screens: rollout detail, confirmation, keyboard help."""
