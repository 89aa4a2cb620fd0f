//! Where the ranks of a job meet when tessera makes its own rendezvous (`tessera load --rank`,
//! `tessera.load`/`tessera.save` without a torch process group). One rule for every front end:
//!
//! - rank 0's address: the flag or argument, else `MASTER_ADDR`;
//! - its port: the flag or argument, else `TESSERA_PORT`, else `MASTER_PORT + 1`.
//!
//! Under torchrun `MASTER_PORT` is already taken by torch's own store (torchrun's agent hosts a
//! TCPStore there, and so does `init_process_group`), so tessera listens on the port after it
//! unless told otherwise. Front ends pass their environment in (`lookup`); nothing here reads
//! it.

use tessera_loader::transport::rendezvous::RendezvousConfig;

use crate::OpsError;

/// The variable that names tessera's rendezvous port outright.
pub const PORT_VAR: &str = "TESSERA_PORT";

/// Rank 0's address and port by the rule of the module doc: `(address, port)`, each `None`
/// where neither the argument nor the environment gives it. A variable that is set but not a
/// port is an error naming it.
pub fn master(
    addr: Option<&str>,
    port: Option<u16>,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<(Option<String>, Option<u16>), OpsError> {
    let var = |name: &str| {
        lookup(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let addr = addr.map(str::to_string).or_else(|| var("MASTER_ADDR"));
    let parse = |name: &str, text: &str| {
        text.parse::<u16>().map_err(|_| {
            OpsError::invalid(format!("{name}={text:?} is not a TCP port (0 to 65535)"))
        })
    };
    let port = match (port, var(PORT_VAR), var("MASTER_PORT")) {
        (Some(port), _, _) => Some(port),
        (None, Some(text), _) => Some(parse(PORT_VAR, &text)?),
        (None, None, Some(text)) => {
            let torch = parse("MASTER_PORT", &text)?;
            Some(torch.checked_add(1).ok_or_else(|| {
                OpsError::invalid(format!(
                    "MASTER_PORT={torch} leaves no port for tessera's rendezvous (it takes \
                     MASTER_PORT + 1): set {PORT_VAR}"
                ))
            })?)
        }
        (None, None, None) => None,
    };
    Ok((addr, port))
}

/// The rendezvous of rank `rank` of a job of `world` ranks (`tessera load --rank`): rank 0's
/// address and port by [`master`], both required. `RANK` and `WORLD_SIZE`, when set, must agree
/// with `rank` and `world` (a launcher that sets them for another rank is a mistake worth
/// stopping on).
pub fn rank_rendezvous(
    addr: Option<&str>,
    port: Option<u16>,
    rank: u32,
    world: u32,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<RendezvousConfig, OpsError> {
    let (addr, port) = master(addr, port, &lookup)?;
    let missing: Vec<&str> = [
        addr.is_none()
            .then_some("the master address (--master-addr HOST or MASTER_ADDR)"),
        port.is_none()
            .then_some("the master port (--master-port PORT, TESSERA_PORT or MASTER_PORT)"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let (Some(master_addr), Some(master_port)) = (addr, port) else {
        return Err(OpsError::invalid(format!(
            "--rank {rank} joins a job of {world} ranks through rank 0, but {} not given: \
             every rank needs rank 0's address (torchrun sets MASTER_ADDR and MASTER_PORT)",
            match missing.as_slice() {
                [one] => format!("{one} is"),
                _ => format!("{} are", missing.join(" and ")),
            }
        )));
    };
    for (name, value, what) in [
        ("RANK", rank, format!("--rank {rank}")),
        (
            "WORLD_SIZE",
            world,
            format!("the layout's world size {world}"),
        ),
    ] {
        if let Some(text) = lookup(name).filter(|v| !v.trim().is_empty())
            && text.trim() != value.to_string()
        {
            return Err(OpsError::invalid(format!(
                "{what} disagrees with {name}={text} in the environment"
            )));
        }
    }
    Ok(RendezvousConfig::new(
        rank,
        world,
        master_addr,
        master_port,
    )?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_string())
        }
    }

    #[test]
    fn the_port_is_the_flag_else_tessera_port_else_the_one_after_torchs() {
        let torchrun = [("MASTER_ADDR", "10.0.0.9"), ("MASTER_PORT", "29500")];
        assert_eq!(
            master(None, None, env(&torchrun)).unwrap(),
            (Some("10.0.0.9".to_string()), Some(29501))
        );
        let with_ours = [("MASTER_PORT", "29500"), (PORT_VAR, " 31000 ")];
        assert_eq!(
            master(Some("h"), None, env(&with_ours)).unwrap(),
            (Some("h".to_string()), Some(31000))
        );
        assert_eq!(
            master(None, Some(7), env(&with_ours)).unwrap(),
            (None, Some(7))
        );
        assert_eq!(master(None, None, env(&[])).unwrap(), (None, None));
        let err = master(None, None, env(&[("MASTER_PORT", "65535")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("set TESSERA_PORT"), "{err}");
        let err = master(None, None, env(&[(PORT_VAR, "x")]))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "TESSERA_PORT=\"x\" is not a TCP port (0 to 65535)");
    }

    #[test]
    fn rank_without_master_says_what_is_missing() {
        let err = rank_rendezvous(None, None, 1, 3, env(&[]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--rank 1 joins a job of 3 ranks through rank 0, but the master address \
             (--master-addr HOST or MASTER_ADDR) and the master port (--master-port PORT, \
             TESSERA_PORT or MASTER_PORT) are not given: every rank needs rank 0's address \
             (torchrun sets MASTER_ADDR and MASTER_PORT)"
        );
        let err = rank_rendezvous(Some("10.0.0.1"), None, 1, 3, env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "but the master port (--master-port PORT, TESSERA_PORT or MASTER_PORT) is not given"
            ),
            "{err}"
        );
        assert!(!err.contains("master address"), "{err}");
    }

    #[test]
    fn flags_and_torchrun_variables_combine() {
        // A flag wins over its variable; the other comes from the environment.
        let vars = [("MASTER_ADDR", "10.0.0.9"), ("MASTER_PORT", "29500")];
        let config = rank_rendezvous(Some("10.0.0.1"), None, 2, 4, env(&vars)).unwrap();
        assert_eq!(
            config,
            RendezvousConfig::new(2, 4, "10.0.0.1", 29501).unwrap()
        );
        let config = rank_rendezvous(None, Some(29500), 2, 4, env(&vars)).unwrap();
        assert_eq!(
            config,
            RendezvousConfig::new(2, 4, "10.0.0.9", 29500).unwrap()
        );

        let bad_port = [("MASTER_ADDR", "h"), ("MASTER_PORT", "http")];
        let err = rank_rendezvous(None, None, 0, 2, env(&bad_port))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "MASTER_PORT=\"http\" is not a TCP port (0 to 65535)");

        let other_rank = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "3")];
        let err = rank_rendezvous(None, None, 1, 4, env(&other_rank))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "--rank 1 disagrees with RANK=3 in the environment");
        let other_world = [("WORLD_SIZE", "8")];
        let err = rank_rendezvous(Some("h"), Some(1), 1, 4, env(&other_world))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the layout's world size 4 disagrees with WORLD_SIZE=8 in the environment"
        );
        let outside = rank_rendezvous(Some("h"), Some(1), 4, 4, env(&[]))
            .unwrap_err()
            .to_string();
        assert!(outside.contains("outside the world"), "{outside}");
    }
}
