"""Pictures of a plan: a self-contained HTML page (`page.save_html`) and Google's Model Explorer (`explorer`), both
drawn from one `view.PlanView` of a lowering."""
