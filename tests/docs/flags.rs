//! The flag reference of `docs/configuration.md`, generated from the clap definition of `kvpick
//! serve` (`kvpick::server::ServeArgs`): every visible flag with its value, default, environment
//! variable and help, grouped under the headings `kvpick serve --help` uses. A second check runs
//! the real binary's `serve --help` and compares its flag list with the page's.

use std::collections::BTreeSet;

use clap::{ArgAction, Args, Command};

const PAGE: &str = "docs/configuration.md";
const SECTION: &str = "kvpick serve flags";

fn serve_command() -> Command {
    let mut cmd = kvpick::server::ServeArgs::augment_args(Command::new("serve"));
    cmd.build();
    cmd
}

/// One line of Markdown table cell text: whitespace collapsed, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn flag_cell(arg: &clap::Arg, long: &str) -> String {
    let takes_value = matches!(arg.get_action(), ArgAction::Set | ArgAction::Append);
    let mut flag = format!("--{long}");
    if takes_value {
        let names: Vec<String> = match arg.get_value_names() {
            Some(names) => names.iter().map(|n| n.to_string()).collect(),
            None => vec![arg.get_id().as_str().to_uppercase()],
        };
        flag = format!("{flag} {}", names.join(" "));
    }
    let mut out = format!("`{}`", cell(&flag));
    if let Some(aliases) = arg.get_visible_aliases() {
        for alias in aliases {
            out.push_str(&format!(" (alias `--{alias}`)"));
        }
    }
    out
}

fn default_cell(arg: &clap::Arg) -> String {
    let values: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if values.is_empty() {
        "—".to_string()
    } else if values.iter().all(|v| v.is_empty()) {
        "(empty)".to_string()
    } else {
        format!("`{}`", cell(&values.join(",")))
    }
}

fn help_cell(arg: &clap::Arg) -> String {
    let help = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let mut text = cell(&help);
    let takes_value = matches!(arg.get_action(), ArgAction::Set | ArgAction::Append);
    let values: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| v.get_name().to_string())
        .collect();
    let is_bool = values.len() == 2 && values.iter().all(|v| v == "true" || v == "false");
    if takes_value && !values.is_empty() && !is_bool {
        let listed: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
        let stop = if text.is_empty() || text.ends_with('.') {
            " "
        } else {
            ". "
        };
        text.push_str(&format!("{stop}Values: {}.", listed.join(", ")));
    }
    text
}

/// The generated Markdown: one table per help heading, flags in declaration order.
fn render() -> String {
    let cmd = serve_command();
    let mut headings: Vec<Option<&str>> = Vec::new();
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && a.get_long().is_some_and(|l| l != "help"))
        .collect();
    for arg in &args {
        if !headings.contains(&arg.get_help_heading()) {
            headings.push(arg.get_help_heading());
        }
    }
    // clap prints flags without a heading first, under "Options".
    headings.sort_by_key(|h| h.is_some());
    let mut out = String::new();
    for heading in headings {
        out.push_str(&format!("\n### {}\n\n", heading.unwrap_or("Options")));
        out.push_str("| flag | default | env | meaning |\n|---|---|---|---|\n");
        for arg in args.iter().filter(|a| a.get_help_heading() == heading) {
            let long = arg.get_long().unwrap_or_default();
            let env = arg
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_else(|| "—".to_string());
            out.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                flag_cell(arg, long),
                default_cell(arg),
                env,
                help_cell(arg)
            ));
        }
    }
    out.push('\n');
    out
}

#[test]
fn the_flag_reference_is_generated_from_clap() {
    crate::generated::check(PAGE, SECTION, &render());
}

/// Long flags at the start of an option line of `--help` (`  -x, --name <V>` or `      --name`).
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let line = match line.strip_prefix('-') {
                Some(rest) if !rest.starts_with('-') => rest.split_once(", ")?.1,
                _ => line,
            };
            let name = line.strip_prefix("--")?;
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(name.len());
            Some(name[..end].to_string())
        })
        .filter(|name| name != "help")
        .collect()
}

#[test]
fn the_page_lists_exactly_the_flags_of_kvpick_serve_help() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpick"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "kvpick serve --help failed");
    let from_help = help_flags(&String::from_utf8(out.stdout).unwrap());
    let page = crate::generated::section(PAGE, SECTION);
    let on_page: BTreeSet<String> = page
        .lines()
        .filter_map(|line| line.strip_prefix("| `--"))
        .map(|rest| {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(rest.len());
            rest[..end].to_string()
        })
        .collect();
    let missing: Vec<&String> = from_help.difference(&on_page).collect();
    let extra: Vec<&String> = on_page.difference(&from_help).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{PAGE} and `kvpick serve --help` disagree: flags missing from the page {missing:?}, \
         flags on the page that kvpick does not have {extra:?}.\nRegenerate with:\n  {}",
        crate::REGENERATE
    );
    assert!(
        from_help.len() > 50,
        "parsed only {} flags",
        from_help.len()
    );
}
