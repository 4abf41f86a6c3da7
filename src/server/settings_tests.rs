use std::ffi::OsString;
use std::time::Duration;

use clap::FromArgMatches;

use super::*;

/// A temp settings file with `text`, removed on drop.
struct File(PathBuf);

impl File {
    fn new(text: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("kvpick-settings-{}.yaml", uuid::Uuid::new_v4()));
        std::fs::write(&path, text).unwrap();
        File(path)
    }
}

impl Drop for File {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `kvpick serve <user> --settings <file>` as `main` resolves it.
fn load(file: &File, user: &[&str]) -> anyhow::Result<ServeArgs> {
    let mut argv: Vec<OsString> = user.iter().map(OsString::from).collect();
    argv.push("--settings".into());
    argv.push(file.0.clone().into());
    let matches = serve_command().try_get_matches_from(&argv).unwrap();
    apply(ServeArgs::from_arg_matches(&matches).unwrap(), argv)
}

fn error(text: &str) -> String {
    let file = File::new(text);
    format!("{:#}", load(&file, &[]).unwrap_err())
}

#[test]
fn file_values_fill_defaults_and_flags_win() {
    let file = File::new(
        "queue-timeout: 30\noverlap-score-credit: 1.5\nsession-headers: [a, b]\n\
         flow-control: false\nallow-pins: true\nkv-events: off\n",
    );
    let args = load(&file, &["--queue-timeout", "7"]).unwrap();
    assert_eq!(args.queue_timeout, 7.0, "the command line wins");
    assert_eq!(args.overlap_score_credit, 1.5);
    assert_eq!(args.session_headers, ["a", "b"]);
    assert!(!args.flow_control);
    assert!(args.allow_pins);
    assert_eq!(args.kv_events, "off");
    let loaded = args.settings_loaded.as_deref().unwrap();
    assert!(!loaded.injected.contains_key("queue-timeout"));
    // Without the file: every default.
    let matches = serve_command()
        .try_get_matches_from(Vec::<OsString>::new())
        .unwrap();
    let plain = apply(ServeArgs::from_arg_matches(&matches).unwrap(), Vec::new()).unwrap();
    assert!(plain.settings_loaded.is_none() && plain.flow_control && !plain.allow_pins);
}

#[test]
fn only_defaults_give_way_to_the_file() {
    // Its own variable: no other test reads it.
    const VAR: &str = "KVPICK_TEST_SETTINGS_PRECEDENCE";
    std::env::set_var(VAR, "from-env");
    let command = || {
        clap::Command::new("t")
            .no_binary_name(true)
            .arg(clap::Arg::new("x").long("x").env(VAR).default_value("d"))
    };
    let env = command().try_get_matches_from(Vec::<&str>::new()).unwrap();
    assert!(!is_default(&env, "x"), "the environment wins over the file");
    let flag = command().try_get_matches_from(["--x", "f"]).unwrap();
    assert!(!is_default(&flag, "x"), "a flag wins over the file");
    std::env::remove_var(VAR);
    let default = command().try_get_matches_from(Vec::<&str>::new()).unwrap();
    assert!(is_default(&default, "x"), "the file wins over a default");
}

#[test]
fn a_false_switch_and_an_empty_file_leave_the_defaults() {
    let args = load(&File::new("allow-pins: false\n"), &[]).unwrap();
    assert!(!args.allow_pins);
    let args = load(&File::new(""), &[]).unwrap();
    assert_eq!(args.queue_timeout, 30.0);
    assert!(args.settings_loaded.unwrap().injected.is_empty());
}

#[test]
fn unknown_keys_are_refused_with_their_line() {
    let err = error("queue-timeout: 3\ncolour: red\n");
    assert!(err.contains("line 2") && err.contains("`colour`"), "{err}");
    assert!(err.contains("unknown setting"), "{err}");
    for key in ["settings", "help", "version"] {
        let err = error(&format!("{key}: x\n"));
        assert!(err.contains("unknown setting"), "{key}: {err}");
    }
    let err = error("queue_timeout: 3\n");
    assert!(err.contains("`queue_timeout`"), "long names only: {err}");
}

#[test]
fn bad_values_name_the_key_and_line() {
    let cases = [
        (
            "overlap-score-credit: 1\nqueue-timeout: soon\n",
            "line 2: `queue-timeout`",
            "invalid value",
        ),
        ("kv-events: maybe\n", "line 1: `kv-events`", "maybe"),
        (
            "allow-pins: yes please\n",
            "line 1: `allow-pins`",
            "true or false",
        ),
        (
            "flow-control: maybe\n",
            "line 1: `flow-control`",
            "invalid value",
        ),
        (
            "queue-timeout:\n",
            "line 1: `queue-timeout`",
            "has no value",
        ),
        (
            "queue-timeout: {a: 1}\n",
            "line 1: `queue-timeout`",
            "must be a string",
        ),
        (
            "queue-timeout: [1, 2]\n",
            "line 1: `queue-timeout`",
            "not a list",
        ),
        (
            "session-headers: []\n",
            "line 1: `session-headers`",
            "empty list",
        ),
        (
            "overlap-score-credit: -1\n",
            "line 1: `overlap-score-credit`",
            "finite number >= 0",
        ),
    ];
    for (text, at, expected) in cases {
        let err = error(text);
        assert!(err.contains(at) && err.contains(expected), "{text}: {err}");
    }
}

#[test]
fn a_value_just_over_a_flags_limit_is_refused() {
    let err = error("queue-timeout: 3600.001\n");
    assert!(
        err.contains("`queue-timeout`") && err.contains("0..=3600"),
        "{err}"
    );
    let args = load(&File::new("queue-timeout: 3600\n"), &[]).unwrap();
    assert_eq!(args.queue_timeout, 3600.0);
    let err = error("sheddable-threshold-fraction: 1.0001\n");
    assert!(err.contains("`sheddable-threshold-fraction`"), "{err}");
}

#[test]
fn malformed_files_are_refused() {
    assert!(error("queue-timeout: [\n").contains("invalid YAML"));
    assert!(error("- a\n- b\n").contains("mapping"));
    assert!(error("1: 2\n").contains("flag names"));
    let big = format!("# {}\n", "x".repeat(MAX_SETTINGS_BYTES));
    assert!(error(&big).contains("byte limit"));
    let just_under = format!("#{}", "x".repeat(MAX_SETTINGS_BYTES - 2));
    assert!(load(&File::new(&just_under), &[]).is_ok());
}

#[test]
fn aliases_are_keys_and_messages_name_whole_flags() {
    let args = load(&File::new("config-file: /etc/catalog.yaml\n"), &[]).unwrap();
    assert_eq!(args.config.unwrap(), PathBuf::from("/etc/catalog.yaml"));
    assert!(names_flag("--queue-timeout must be", "queue-timeout"));
    assert!(names_flag("x --queue-timeout", "queue-timeout"));
    assert!(!names_flag("--queue-timeout-ms must be", "queue-timeout"));
}

#[test]
fn live_keys_are_flags() {
    let command = serve_command();
    for key in LIVE_KEYS {
        assert!(
            command.get_arguments().any(|a| a.get_long() == Some(key)),
            "{key}"
        );
    }
}

fn loaded_core(text: &str, user: &[&str]) -> (File, Loaded, kvpick_core::Core) {
    let file = File::new(text);
    let args = load(&file, user).unwrap();
    let core = kvpick_core::Core::new(core_config(&args).unwrap());
    let loaded = (*args.settings_loaded.unwrap()).clone();
    (file, loaded, core)
}

#[test]
fn reloads_apply_live_settings_and_keep_the_last_good_ones() {
    let (_file, mut loaded, core) =
        loaded_core("overlap-score-credit: 1.5\nqueue-timeout: 3\n", &[]);
    assert_eq!(core.config().cost.overlap_score_credit, 1.5);
    let next = "overlap-score-credit: 2\nqueue-timeout: 4\nsession-soft-margin: 8\n".to_string();
    let reload = loaded.reload(next.clone(), &core);
    assert!(
        matches!(&reload, Reload::Applied { restart } if restart.is_empty()),
        "{reload:?}"
    );
    let config = core.config();
    assert_eq!(config.cost.overlap_score_credit, 2.0);
    assert_eq!(config.flow.queue_timeout, Duration::from_secs(4));
    assert_eq!(config.sessions.soft_margin_blocks, 8.0);
    assert!(matches!(loaded.reload(next, &core), Reload::Unchanged));

    for bad in [
        "overlap-score-credit: 3\nqueue-timeout: soon\n",
        "overlap-score-credit: 3\nqueue-timeout: 3600.5\n",
        "overlap-score-credit: 3\ncolour: red\n",
        "overlap-score-credit: [3\n",
    ] {
        let reload = loaded.reload(bad.to_string(), &core);
        assert!(matches!(reload, Reload::Invalid(_)), "{bad}: {reload:?}");
        assert_eq!(core.config().cost.overlap_score_credit, 2.0, "{bad}");
    }
    let oversized = format!("#{}", "x".repeat(MAX_SETTINGS_BYTES));
    assert!(matches!(
        loaded.reload(oversized, &core),
        Reload::Invalid(_)
    ));
    // Removing a key returns it to its default.
    let reload = loaded.reload("queue-timeout: 4\n".to_string(), &core);
    assert!(
        matches!(&reload, Reload::Applied { restart } if restart.is_empty()),
        "{reload:?}"
    );
    assert_eq!(core.config().cost.overlap_score_credit, 1.0);
}

#[test]
fn a_setting_that_is_not_live_needs_a_restart_and_is_not_applied() {
    let (_file, mut loaded, core) = loaded_core("index-max-blocks: 1000\n", &[]);
    let reload = loaded.reload(
        "index-max-blocks: 2000\nstall-weight: 2\n".to_string(),
        &core,
    );
    match reload {
        Reload::Applied { restart } => assert_eq!(restart, ["index-max-blocks"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(core.config().index_max_blocks, 1000);
    assert_eq!(
        core.config().cost.stall_weight,
        2.0,
        "the live part still applies"
    );
    // Reported once: the next edit of a live key alone is ok.
    let reload = loaded.reload(
        "index-max-blocks: 2000\nstall-weight: 3\n".to_string(),
        &core,
    );
    assert!(
        matches!(&reload, Reload::Applied { restart } if restart.is_empty()),
        "{reload:?}"
    );
}

#[test]
fn a_key_the_command_line_sets_is_ignored_on_reload() {
    let (_file, mut loaded, core) = loaded_core("stall-weight: 2\n", &["--stall-weight", "5"]);
    assert_eq!(core.config().cost.stall_weight, 5.0);
    let reload = loaded.reload("stall-weight: 7\nindex-max-blocks: 9\n".to_string(), &core);
    match reload {
        Reload::Applied { restart } => assert_eq!(restart, ["index-max-blocks"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(core.config().cost.stall_weight, 5.0);
}

#[test]
fn the_documented_example_loads() {
    let doc = include_str!("../../docs/configuration.md");
    let start = doc.find("# kvpick-settings.yaml\n").unwrap();
    let example = &doc[start..start + doc[start..].find("```").unwrap()];
    let args = load(&File::new(example), &[]).unwrap();
    assert_eq!(args.overlap_score_credit, 1.5);
    assert_eq!(
        args.session_headers,
        ["x-session-id", "x-dynamo-session-id"]
    );
    assert_eq!(args.index_max_blocks, 2_097_152);
}

/// `--tokenizer-dir` repeats (a list in the settings file); the tokenizer queue's old flag names
/// set the stall timeout that replaced the fixed queue wait.
#[test]
fn tokenizer_dirs_are_a_list_and_the_old_queue_flag_sets_the_stall_timeout() {
    let file =
        File::new("tokenizer-dir: [a=/models/a, b=/models/b]\ntokenize-queue-max-bytes: 1000\n");
    let args = load(&file, &["--tokenize-queue-timeout-ms", "700"]).unwrap();
    assert_eq!(args.tokenizer_dir, ["a=/models/a", "b=/models/b"]);
    assert_eq!(args.tokenize_queue_max_bytes, Some(1000));
    assert_eq!(args.tokenize_stall_ms, 700);
    let file = File::new("");
    let args = load(&file, &["--tokenize-permit-timeout-ms=20"]).unwrap();
    assert_eq!(args.tokenize_stall_ms, 20);
    assert_eq!(args.tokenize_queue_max_bytes, None, "default: per thread");
    assert!(args.tokenizer_dir.is_empty());
}

#[test]
fn endpoint_scores_flags_default_off_bounded_1_to_1024() {
    let parse = |argv: &[&str]| {
        serve_command()
            .try_get_matches_from(argv.iter().map(OsString::from))
            .map(|m| ServeArgs::from_arg_matches(&m).unwrap())
    };
    let plain = parse(&[]).unwrap();
    assert!(!plain.emit_endpoint_scores);
    assert_eq!(
        plain.endpoint_scores_limit,
        crate::server::DEFAULT_ENDPOINT_SCORES_LIMIT
    );
    let at_cap = parse(&["--emit-endpoint-scores", "--endpoint-scores-limit", "1024"]).unwrap();
    assert!(at_cap.emit_endpoint_scores);
    assert_eq!(at_cap.endpoint_scores_limit, 1024);
    for over in ["0", "1025"] {
        let err = parse(&["--endpoint-scores-limit", over])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--endpoint-scores-limit") && err.contains("must be 1..=1024"),
            "{over}: {err}"
        );
    }
    // The settings file names it like any flag.
    let file = File::new("emit-endpoint-scores: true\nendpoint-scores-limit: 4\n");
    let args = load(&file, &[]).unwrap();
    assert!(args.emit_endpoint_scores);
    assert_eq!(args.endpoint_scores_limit, 4);
}
