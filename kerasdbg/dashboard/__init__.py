"""kerasdbg's dashboard in TensorBoard (`tensorboard --logdir runs`, tab "kerasdbg")."""

from kerasdbg.dashboard.dashboard_plugin import DashboardPlugin

__all__ = ("DashboardPlugin",)
