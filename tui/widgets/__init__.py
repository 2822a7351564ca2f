"""The dashboard's widgets, one per module; each draws from a ``tui.model.DashboardModel``."""
