//! Auth on a cluster: a `root` user every harness client logs in as, and users holding exactly
//! the permissions a test gives them, as an operator following docs/operations.md would.

use mirror_core::Auth;

use super::EtcdCluster;

impl EtcdCluster {
    /// Turns auth on with a `root` user (every harness client logs in as it from now on) and a
    /// user `user` whose one role holds exactly `permissions`. Returns the config of that user
    /// for the agent (`[source.auth]` / `[target.auth]`), its password in a file of the cluster.
    pub async fn enable_auth(
        &mut self,
        user: &str,
        permissions: Vec<etcd_client::Permission>,
    ) -> anyhow::Result<Auth> {
        let mut c = self.client().await?;
        c.user_add("root", "root-pw", None).await?;
        c.user_grant_role("root", "root").await?;
        let auth = self.add_user(user, permissions).await?;
        self.client().await?.auth_enable().await?;
        self.root = Some(self.password_of("root", "root-pw")?);
        Ok(auth)
    }

    /// Adds a user `user` whose one role (of the same name) holds exactly `permissions`, on a
    /// cluster with auth on or off; its config for the agent, the password in a file.
    pub async fn add_user(
        &self,
        user: &str,
        permissions: Vec<etcd_client::Permission>,
    ) -> anyhow::Result<Auth> {
        let mut c = self.client().await?;
        c.role_add(user).await?;
        for perm in permissions {
            c.role_grant_permission(user, perm).await?;
        }
        let password = format!("{user}-pw");
        c.user_add(user, password.as_str(), None).await?;
        c.user_grant_role(user, user).await?;
        self.password_of(user, &password)
    }

    /// The root user's credentials once [`EtcdCluster::enable_auth`] ran, for commands that
    /// take admin credentials of their own (`snapshot save --admin-user`).
    pub fn root(&self) -> Option<&Auth> {
        self.root.as_ref()
    }

    /// After this cluster was restored from a snapshot of `other` (which copies its auth
    /// store): harness clients log in as `other`'s root.
    pub fn logs_in_as_root_of(&mut self, other: &EtcdCluster) {
        self.root = other.root.clone();
    }

    /// The agent config of `user`, its `password` written to a file of the cluster.
    fn password_of(&self, user: &str, password: &str) -> anyhow::Result<Auth> {
        let file = self._data.path().join(format!("{user}.password"));
        std::fs::write(&file, format!("{password}\n"))?;
        Ok(Auth { username: user.to_owned(), password_file: Some(file), ..Default::default() })
    }
}
