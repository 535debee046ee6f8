"""Paper-style figures (matplotlib; PNG for the page, PDF with TrueType fonts for papers), in three
steps:

1. plan (`plan.plan_figures`): which figures the stored rows call for, one `FigureJob` per file
   holding exactly the numbers it draws;
2. draw (`draw.draw`): the matplotlib figure of one job;
3. write (`write.render_figures`): each job's PNG and PDF, in parallel worker processes, skipped
   when the same numbers were drawn by the same code before.
"""

from suite.reports.figures.plan import FigureJob, plan_figures
from suite.reports.figures.write import render_figures

__all__ = ["FigureJob", "plan_figures", "render_figures"]
